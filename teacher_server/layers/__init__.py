"""Small reusable layers the model families are built from: parallel linear projections,
RMSNorm, rotary tables, SiLU-mul, vocab-parallel embedding and LM head, the expert weights.
Each parameter knows how to load its slice of a Hugging Face weight (``load_weight``); the
layers with weight matrices hold, shard and apply them through a weight format (``formats``)."""
