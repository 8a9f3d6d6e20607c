"""The layers the models are composed of: each a small class holding typed weights (built once
from the loaded weight dict) whose forward calls the engine's kernel API (`ops`) only.

norm: RMSNorm; rope: the rotary embedding (YaRN included); linear: a projection with its tensor-
parallel split; mlp: the dense SwiGLU MLP; moe: routing (DeepSeek-V3's grouped sigmoid, V4's
sqrt-softplus and hash) and the routed + shared experts; mla: DeepSeek-V3's MLA attention;
hyper_connections, v4_attention, v4_compressor, v4_indexer, v4_verify, v4_step: DeepSeek-V4's own.
Layers import no model (tests/unit/house/test_model_layers.py)."""
