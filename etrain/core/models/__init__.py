"""Model definitions beside the GPT of etrain/core/model.py, one file each."""
