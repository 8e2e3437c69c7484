"""Export to Hugging Face transformers, generation, and importing the nonlinear-query authors' checkpoints."""
