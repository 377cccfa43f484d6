"""The optimizers (AdamW, Muon, NorMuon) and the learning-rate schedule."""
