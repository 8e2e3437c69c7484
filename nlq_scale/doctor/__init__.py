"""`nlq-scale doctor`: check a fresh (GPU) node before submitting a ladder."""
