"""`teratron bench`: timed training at the benchmark shape next to the Hugging Face baseline."""
