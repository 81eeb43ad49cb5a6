"""Training side: arguments, DeepSpeed config, checkpoints, logging and the loop."""
