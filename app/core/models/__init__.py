"""Model definitions beside the GPT of app/core/model.py, one file each."""
