"""`teratron train`: flags -> configs (`arguments`), the loop (`training.pretrain`), throughput and
logging (`metrics`), the MoE hooks of a step (`moe_step`), checkpoints (`checkpointing`), the
micro-batch calculator and the demo."""
