"""The reference models (GPT, BERT) and their Hugging Face mappings, installed with megazero."""
