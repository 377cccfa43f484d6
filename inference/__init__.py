"""Running a trained model: the one loader of runs and folders, the terminal chat, faster CPU products."""
