"""Small reusable layers the model families are built from: parallel linear projections,
RMSNorm, rotary tables, SiLU-mul, vocab-parallel embedding and LM head. Each parameter
knows how to load its slice of a Hugging Face weight (``load_weight``)."""
