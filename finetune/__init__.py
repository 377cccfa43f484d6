"""Fine-tuning beside a frozen model: LoRA adapters, their merge and their export."""
