"""transformers families at tiny sizes, built from their config classes (nothing is downloaded).

`build(name)` gives the model (random weights, fixed seed is the caller's) and `make(batch, seq,
seed)`, which returns one call's keyword inputs, labels included, so that every family returns a
loss. The common shape is hidden 32, 2 layers, 4 heads (head dim 8), MLP 64, vocabulary 64, with
pad/bos/eos token ids 0 and the KV cache off. Used by examples/sweep_hf.py and tests/test_hf_sweep.py.

    >>> model, make = build("llama")
    >>> sorted(make(4, 8, seed=1))
    ['attention_mask', 'input_ids', 'labels']
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

VOCAB = 64
LABELS = 4  # classes of the image and sequence classifiers
TOKENS = dict(pad_token_id=0, bos_token_id=0, eos_token_id=0, decoder_start_token_id=0, use_cache=False)

STD = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
           max_position_embeddings=64)
GQA = dict(STD, num_key_value_heads=2)  # 2 KV heads for 4 query heads
GPT = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
BART = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)
T5 = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=16,
           patch_size=4, num_labels=LABELS)
# router load-balancing loss on, as in MoE training: the loss then depends on every router logit
MOE = dict(GQA, num_experts_per_tok=2, output_router_logits=True)


@dataclass(frozen=True)
class Family:
    model: str  # transformers model class
    config: str  # its config class
    kw: dict  # config fields (TOKENS are added to every family)
    inputs: str  # a key of MAKERS
    kind: str  # decoder | encoder | encoder-decoder | vision | moe
    why: str = ""  # what this family exercises that its neighbours do not
    extra: dict = field(default_factory=dict)  # keyword inputs added to every call


def _d(*parts, **over) -> dict:
    out = {}
    for p in parts:
        out.update(p)
    out.update(over)
    return out


FAMILIES = {
    # decoder LMs
    "gpt2": Family("GPT2LMHeadModel", "GPT2Config", GPT, "causal", "decoder", "Conv1D, fused c_attn, tied head"),
    "gpt_neo": Family("GPTNeoForCausalLM", "GPTNeoConfig",
                      _d(STD, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]], window_size=4),
                      "causal", "decoder", "local (windowed) attention layer, unscaled scores"),
    "gptj": Family("GPTJForCausalLM", "GPTJConfig", _d(GPT, rotary_dim=4), "causal", "decoder",
                   "parallel attention+MLP, interleaved partial rotary"),
    "gpt_neox": Family("GPTNeoXForCausalLM", "GPTNeoXConfig", STD, "causal", "decoder",
                       "fused qkv interleaved per head, partial rotary, untied head"),
    "gpt_bigcode": Family("GPTBigCodeForCausalLM", "GPTBigCodeConfig", GPT, "causal", "decoder",
                          "multi-query attention (1 KV head) in a fused c_attn"),
    "codegen": Family("CodeGenForCausalLM", "CodeGenConfig", _d(GPT, n_ctx=64, rotary_dim=4), "causal", "decoder",
                      "qkv fused in mp_num=4 groups, rotary"),
    "bloom": Family("BloomForCausalLM", "BloomConfig", _d(hidden_size=32, n_layer=2, n_head=4, vocab_size=VOCAB),
                    "causal", "decoder", "ALiBi bias, embedding LayerNorm, baddbmm attention"),
    "falcon": Family("FalconForCausalLM", "FalconConfig", STD, "causal", "decoder",
                     "multi-query fused qkv, parallel attention"),
    "opt": Family("OPTForCausalLM", "OPTConfig", _d(STD, ffn_dim=64, word_embed_proj_dim=32), "causal", "decoder",
                  "learned positions with offset 2"),
    "llama": Family("LlamaForCausalLM", "LlamaConfig", GQA, "causal", "decoder", "RMSNorm, rotary, GQA, SwiGLU"),
    "mistral": Family("MistralForCausalLM", "MistralConfig", _d(STD, num_key_value_heads=1, sliding_window=4),
                      "causal", "decoder", "sliding-window mask, 1 KV head"),
    "qwen2": Family("Qwen2ForCausalLM", "Qwen2Config", GQA, "causal", "decoder", "q/k/v bias"),
    "qwen3": Family("Qwen3ForCausalLM", "Qwen3Config", _d(GQA, head_dim=8), "causal", "decoder",
                    "per-head q/k RMSNorm"),
    "gemma": Family("GemmaForCausalLM", "GemmaConfig", _d(GQA, head_dim=8), "causal", "decoder",
                    "embedding scaled by sqrt(h), (1+w) RMSNorm, GeGLU"),
    "gemma2": Family("Gemma2ForCausalLM", "Gemma2Config", _d(GQA, head_dim=8, sliding_window=4), "causal", "decoder",
                     "logit soft-capping, sandwich norms, alternating sliding window"),
    "gemma3_text": Family("Gemma3ForCausalLM", "Gemma3TextConfig", _d(GQA, head_dim=8, sliding_window=4),
                          "causal", "decoder", "q/k norm, local/global rotary bases"),
    "phi": Family("PhiForCausalLM", "PhiConfig", STD, "causal", "decoder",
                  "partial rotary, parallel block, dense head bias"),
    "phi3": Family("Phi3ForCausalLM", "Phi3Config", STD, "causal", "decoder", "fused qkv_proj and gate_up_proj"),
    "stablelm": Family("StableLmForCausalLM", "StableLmConfig", GQA, "causal", "decoder", "LayerNorm + partial rotary"),
    "olmo": Family("OlmoForCausalLM", "OlmoConfig", STD, "causal", "decoder", "non-parametric LayerNorm"),
    "olmo2": Family("Olmo2ForCausalLM", "Olmo2Config", STD, "causal", "decoder",
                    "q/k RMSNorm over all heads, post-norm"),
    "starcoder2": Family("Starcoder2ForCausalLM", "Starcoder2Config", GQA, "causal", "decoder",
                         "LayerNorm with bias, GELU MLP with bias"),
    "cohere": Family("CohereForCausalLM", "CohereConfig", GQA, "causal", "decoder",
                     "parallel block, bias-free LayerNorm, logit scale"),
    "granite": Family("GraniteForCausalLM", "GraniteConfig", _d(GQA, embedding_multiplier=2.0, logits_scaling=4.0),
                      "causal", "decoder", "embedding/residual/logit multipliers"),
    "persimmon": Family("PersimmonForCausalLM", "PersimmonConfig", STD, "causal", "decoder",
                        "fused qkv, q/k LayerNorm, squared ReLU"),
    "biogpt": Family("BioGptForCausalLM", "BioGptConfig", STD, "causal", "decoder",
                     "scaled embeddings, learned positions from the mask"),
    "xglm": Family("XGLMForCausalLM", "XGLMConfig",
                   dict(vocab_size=VOCAB, d_model=32, num_layers=2, attention_heads=4, ffn_dim=64,
                        max_position_embeddings=64), "causal", "decoder", "sinusoidal positions"),
    "mpt": Family("MptForCausalLM", "MptConfig", dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4,
                                                     expansion_ratio=2, max_seq_len=64),
                  "causal", "decoder", "ALiBi, fused Wqkv, bias-free LayerNorm"),
    "nemotron": Family("NemotronForCausalLM", "NemotronConfig", _d(GQA, head_dim=8), "causal", "decoder",
                       "(1+w) LayerNorm, squared ReLU, partial rotary"),
    "glm": Family("GlmForCausalLM", "GlmConfig", _d(GQA, head_dim=8), "causal", "decoder",
                  "fused gate_up, interleaved partial rotary"),
    "exaone4": Family("Exaone4ForCausalLM", "Exaone4Config", _d(GQA, head_dim=8, sliding_window=4), "causal",
                      "decoder", "post-norm with q/k norm, hybrid sliding window"),
    "smollm3": Family("SmolLM3ForCausalLM", "SmolLM3Config", GQA, "causal", "decoder", "rotary skipped in some layers"),
    "gpt_neox_japanese": Family("GPTNeoXJapaneseForCausalLM", "GPTNeoXJapaneseConfig",
                                dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_multiple_size=2, max_position_embeddings=64),
                                "causal", "decoder", "dense bias added after the residual, fused qkv"),
    "llama_left_pad": Family("LlamaForCausalLM", "LlamaConfig", GQA, "causal_left", "decoder",
                             "left padding: query rows with every key masked"),
    "helium": Family("HeliumForCausalLM", "HeliumConfig", _d(GQA, head_dim=8), "causal", "decoder",
                     "Llama-like, head_dim set"),
    # MoE decoders
    "mixtral": Family("MixtralForCausalLM", "MixtralConfig", _d(MOE, num_local_experts=4), "causal", "moe",
                      "top-2 router, grouped expert matmul"),
    "qwen2_moe": Family("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                        _d(MOE, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32),
                        "causal", "moe", "shared expert with a sigmoid gate"),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", "Qwen3MoeConfig", _d(MOE, num_experts=4, moe_intermediate_size=32,
                                                                    head_dim=8),
                        "causal", "moe", "normalized top-k probabilities"),
    "olmoe": Family("OlmoeForCausalLM", "OlmoeConfig", _d(MOE, num_experts=4), "causal", "moe", "q/k norm + MoE"),
    "phimoe": Family("PhimoeForCausalLM", "PhimoeConfig", _d(MOE, num_local_experts=4), "causal", "moe",
                     "sparsemixer router (torch.no_grad region)"),
    "granitemoe": Family("GraniteMoeForCausalLM", "GraniteMoeConfig", _d(MOE, num_local_experts=4), "causal", "moe",
                         "parallel experts as one batched weight"),
    "dbrx": Family("DbrxForCausalLM", "DbrxConfig",
                   dict(vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2, max_seq_len=64, output_router_logits=True,
                        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                        ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2)),
                   "causal", "moe", "experts stored as one fused parameter per layer, clip_qkv"),
    "jamba": Family("JambaForCausalLM", "JambaConfig",
                    _d(MOE, num_experts=4, attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1,
                       expert_layer_period=2, mamba_d_state=4, mamba_d_conv=4, mamba_dt_rank=4),
                    "causal", "moe", "Mamba layer (sequential scan, depthwise conv) next to attention + MoE"),
    "llama4_text": Family("Llama4ForCausalLM", "Llama4TextConfig",
                          _d(MOE, head_dim=8, num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=64,
                             interleave_moe_layer_step=1, attention_chunk_size=4),
                          "causal", "moe", "sigmoid top-1 router with a shared expert, chunked attention, NoPE layers"),
    "deepseek_v3": Family("DeepseekV3ForCausalLM", "DeepseekV3Config",
                          _d(MOE, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, n_group=2,
                             topk_group=1, first_k_dense_replace=1, moe_intermediate_size=16, kv_lora_rank=16,
                             q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                             routed_scaling_factor=2.5),
                          "causal", "moe", "grouped sigmoid router with a score bias, shared expert, latent attention"),
    # encoders (masked LM unless stated)
    "bert": Family("BertForMaskedLM", "BertConfig", STD, "masked_types", "encoder", "padding mask, token types"),
    "roberta": Family("RobertaForMaskedLM", "RobertaConfig", _d(STD, max_position_embeddings=72), "masked", "encoder",
                      "positions counted from the padding mask"),
    "xlm_roberta": Family("XLMRobertaForMaskedLM", "XLMRobertaConfig", _d(STD, max_position_embeddings=72), "masked",
                          "encoder", "as roberta"),
    "camembert": Family("CamembertForMaskedLM", "CamembertConfig", _d(STD, max_position_embeddings=72), "masked",
                        "encoder", "as roberta"),
    "data2vec_text": Family("Data2VecTextForMaskedLM", "Data2VecTextConfig", _d(STD, max_position_embeddings=72),
                            "masked", "encoder", "as roberta"),
    "distilbert": Family("DistilBertForMaskedLM", "DistilBertConfig",
                         dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                              max_position_embeddings=64),
                         "masked", "encoder", "no token types, q_lin/k_lin names"),
    "albert": Family("AlbertForMaskedLM", "AlbertConfig", _d(STD, embedding_size=16), "masked_types", "encoder",
                     "factorized embedding 16->32, one layer shared by both"),
    "electra": Family("ElectraForMaskedLM", "ElectraConfig", _d(STD, embedding_size=16), "masked_types", "encoder",
                      "embedding projection, generator head"),
    "deberta": Family("DebertaForMaskedLM", "DebertaConfig",
                      _d(STD, relative_attention=True, pos_att_type=["c2p", "p2c"], max_relative_positions=16),
                      "masked", "encoder", "disentangled attention, gathers on relative positions"),
    "deberta_v2": Family("DebertaV2ForMaskedLM", "DebertaV2Config",
                         _d(STD, relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=8,
                            norm_rel_ebd="layer_norm", share_att_key=True, max_relative_positions=-1),
                         "masked", "encoder", "log-bucketed relative positions (deberta-v3 settings)"),
    "megatron_bert": Family("MegatronBertForMaskedLM", "MegatronBertConfig", STD, "masked_types", "encoder",
                            "pre-LayerNorm BERT"),
    "mpnet": Family("MPNetForMaskedLM", "MPNetConfig", _d(STD, max_position_embeddings=72), "masked", "encoder",
                    "relative position bias buckets"),
    "roformer": Family("RoFormerForMaskedLM", "RoFormerConfig", _d(STD, embedding_size=32), "masked_types", "encoder",
                       "rotary in an encoder"),
    "ernie": Family("ErnieForMaskedLM", "ErnieConfig", STD, "masked_types", "encoder", "task type embeddings"),
    "convbert": Family("ConvBertForMaskedLM", "ConvBertConfig", _d(STD, embedding_size=32), "masked_types", "encoder",
                       "span-based dynamic convolution, grouped linear"),
    "modernbert": Family("ModernBertForMaskedLM", "ModernBertConfig",
                         _d(STD, global_attn_every_n_layers=2, local_attention=4, cls_token_id=0, sep_token_id=0),
                         "masked", "encoder", "fused Wqkv, GeGLU, local/global attention"),
    "big_bird": Family("BigBirdForMaskedLM", "BigBirdConfig",
                       _d(STD, block_size=1, num_random_blocks=1, sep_token_id=0), "masked_types",
                       "encoder", "block-sparse attention with random blocks"),
    "funnel": Family("FunnelForMaskedLM", "FunnelConfig",
                     dict(vocab_size=VOCAB, block_sizes=[1, 1], num_decoder_layers=1, d_model=32, n_head=4, d_head=8,
                          d_inner=64), "masked_types", "encoder",
                     "sequence pooled by 2 between blocks, upsampled back"),
    "mobilebert": Family("MobileBertForMaskedLM", "MobileBertConfig",
                         _d(STD, embedding_size=16, intra_bottleneck_size=16, true_hidden_size=16,
                            num_feedforward_networks=2), "masked_types", "encoder",
                         "bottlenecks, NoNorm, trigram embedding input"),
    "squeezebert": Family("SqueezeBertForMaskedLM", "SqueezeBertConfig",
                          _d(STD, embedding_size=32, q_groups=2, k_groups=2, v_groups=2, post_attention_groups=2,
                             intermediate_groups=2, output_groups=2), "masked_types", "encoder",
                          "grouped 1x1 convolutions in place of linears, channels-first"),
    "rembert": Family("RemBertForMaskedLM", "RemBertConfig", _d(STD, input_embedding_size=16, output_embedding_size=16),
                      "masked_types", "encoder", "decoupled input/output embeddings"),
    "xlm_roberta_xl": Family("XLMRobertaXLForMaskedLM", "XLMRobertaXLConfig", _d(STD, max_position_embeddings=72),
                             "masked", "encoder", "pre-LayerNorm roberta"),
    "bert_cls": Family("BertForSequenceClassification", "BertConfig", _d(STD, num_labels=LABELS), "classify",
                       "encoder", "pooler + classifier on [CLS]"),
    # encoder-decoders
    "t5": Family("T5ForConditionalGeneration", "T5Config", T5, "seq2seq", "encoder-decoder",
                 "relative position bias, cross-attention, tied head rescaled"),
    "mt5": Family("MT5ForConditionalGeneration", "MT5Config", T5, "seq2seq", "encoder-decoder",
                  "gated-GELU T5, untied head"),
    "umt5": Family("UMT5ForConditionalGeneration", "UMT5Config", T5, "seq2seq", "encoder-decoder",
                   "relative bias in every layer"),
    "bart": Family("BartForConditionalGeneration", "BartConfig", BART, "seq2seq", "encoder-decoder",
                   "learned positions with offset, final_logits_bias buffer"),
    "mbart": Family("MBartForConditionalGeneration", "MBartConfig", BART, "seq2seq", "encoder-decoder",
                    "pre-norm BART, labels shifted with the last token"),
    "pegasus": Family("PegasusForConditionalGeneration", "PegasusConfig", BART, "seq2seq", "encoder-decoder",
                      "sinusoidal positions"),
    "marian": Family("MarianMTModel", "MarianConfig", BART, "seq2seq", "encoder-decoder",
                     "sinusoidal, scaled embedding"),
    "plbart": Family("PLBartForConditionalGeneration", "PLBartConfig", BART, "seq2seq", "encoder-decoder", "as mbart"),
    "m2m_100": Family("M2M100ForConditionalGeneration", "M2M100Config", BART, "seq2seq", "encoder-decoder",
                      "sinusoidal positions from the mask"),
    "blenderbot_small": Family("BlenderbotSmallForConditionalGeneration", "BlenderbotSmallConfig", BART, "seq2seq",
                               "encoder-decoder", "post-norm with embedding LayerNorm"),
    "blenderbot": Family("BlenderbotForConditionalGeneration", "BlenderbotConfig", BART, "seq2seq", "encoder-decoder",
                         "pre-norm, learned positions without offset"),
    "led": Family("LEDForConditionalGeneration", "LEDConfig",
                  _d(BART, max_encoder_position_embeddings=64, max_decoder_position_embeddings=64,
                     attention_window=[4, 4]),
                  "seq2seq", "encoder-decoder", "Longformer sliding-chunk attention in the encoder"),
    "longt5": Family("LongT5ForConditionalGeneration", "LongT5Config",
                     _d(T5, encoder_attention_type="transient-global", local_radius=2, global_block_size=4),
                     "seq2seq", "encoder-decoder", "transient-global attention over blocks"),
    "nllb_moe": Family("NllbMoeForConditionalGeneration", "NllbMoeConfig",
                       _d(BART, num_experts=4, expert_capacity=8, encoder_sparse_step=2, decoder_sparse_step=2),
                       "seq2seq", "moe", "top-2 experts with capacity in an encoder-decoder"),
    "switch_transformers": Family("SwitchTransformersForConditionalGeneration", "SwitchTransformersConfig",
                                  _d(T5, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, num_experts=4,
                                     expert_capacity=8, num_decoder_layers=2),
                                  "seq2seq", "moe", "top-1 experts with capacity in an encoder-decoder"),
    # vision
    "vit": Family("ViTForImageClassification", "ViTConfig", VIT, "image", "vision", "conv patch embedding, CLS token"),
    "deit": Family("DeiTForImageClassification", "DeiTConfig", VIT, "image", "vision", "as ViT"),
    "beit": Family("BeitForImageClassification", "BeitConfig", _d(VIT, use_relative_position_bias=True),
                   "image", "vision", "relative position bias table, layer scale, mean pooling"),
    "dinov2": Family("Dinov2ForImageClassification", "Dinov2Config", VIT, "image", "vision",
                     "interpolated positions, layer scale, CLS+mean head"),
    "swin": Family("SwinForImageClassification", "SwinConfig",
                   dict(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4,
                        num_labels=LABELS), "image32", "vision", "shifted windows, patch merging"),
    "segformer": Family("SegformerForImageClassification", "SegformerConfig",
                        dict(image_size=32, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                             hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2],
                             mlp_ratios=[2, 2], num_labels=LABELS), "image32", "vision",
                        "overlapping conv patches, spatially reduced keys, depthwise conv in the MLP"),
    "resnet": Family("ResNetForImageClassification", "ResNetConfig",
                     dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic",
                          num_labels=LABELS), "image32", "vision",
                     "convolutions and BatchNorm only (no matmul to split)"),
    "convnext": Family("ConvNextForImageClassification", "ConvNextConfig",
                       dict(image_size=32, num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=LABELS),
                       "image32", "vision", "depthwise convolutions, channels-last LayerNorm"),
}


def _ids(b, s, seed):
    return torch.randint(1, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


def _padded(b, s):
    mask = torch.ones(b, s, dtype=torch.long)
    mask[0, s - 2:] = 0  # one sequence right-padded by 2
    return mask


def causal(b, s, seed):
    ids, mask = _ids(b, s, seed), _padded(b, s)
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


def causal_left(b, s, seed):
    ids, mask = _ids(b, s, seed), torch.ones(b, s, dtype=torch.long)
    mask[0, :2] = 0  # one sequence left-padded by 2, as batched generation prompts are
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


def masked(b, s, seed, types=False):
    ids, mask = _ids(b, s, seed), _padded(b, s)
    labels = _ids(b, s, seed + 100).masked_fill(mask == 0, -100)
    labels[:, ::3] = -100  # positions that are not predicted
    kw = dict(input_ids=ids, attention_mask=mask, labels=labels)
    if types:
        kw["token_type_ids"] = (torch.arange(s) >= s // 2).long().expand(b, s)
    return kw


def classify(b, s, seed):
    g = torch.Generator().manual_seed(seed + 100)
    return dict(input_ids=_ids(b, s, seed), attention_mask=_padded(b, s),
                labels=torch.randint(0, LABELS, (b,), generator=g))


def seq2seq(b, s, seed):
    mask = torch.ones(b, s, dtype=torch.long)
    mask[-1, -2:] = 0
    return dict(input_ids=_ids(b, s, seed), attention_mask=mask, labels=_ids(b, max(s // 2, 1), seed + 100))


def image(b, s, seed, size=16):
    """`s` is unused: images have a fixed size."""
    g = torch.Generator().manual_seed(seed)
    return dict(pixel_values=torch.randn(b, 3, size, size, generator=g),
                labels=torch.randint(0, LABELS, (b,), generator=g))


MAKERS = {
    "causal": causal, "causal_left": causal_left, "masked": masked,
    "masked_types": lambda b, s, seed: masked(b, s, seed, types=True),
    "classify": classify, "seq2seq": seq2seq, "image": image, "image32": lambda b, s, seed: image(b, s, seed, 32),
}


def build(name: str, **over):
    """(model, make) for a family; make(batch, seq, seed) -> one call's keyword inputs. `over`: config
    fields that replace the family's (another expert count, say)."""
    import transformers

    if name not in FAMILIES:
        raise ValueError(f"unknown family {name!r}: expected one of {', '.join(sorted(FAMILIES))}")
    fam = FAMILIES[name]
    config = getattr(transformers, fam.config)(**{**TOKENS, **fam.kw, **over})
    model = getattr(transformers, fam.model)(config)
    maker = MAKERS[fam.inputs]

    def make(batch, seq, seed):
        return {**maker(batch, seq, seed), **fam.extra}

    return model, make
