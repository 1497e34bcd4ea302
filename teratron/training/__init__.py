"""`teratron train`: flags -> configs (`arguments`), the loop (`training.pretrain`), throughput and
logging (`metrics`), checkpoints (`checkpointing`), the micro-batch calculator and the demo."""
