"""Tiny diffusers models on CPU, for the installer's tests and the diffusers sweep: every model
class of diffusers 0.42.1 that checkpoints its blocks, built small enough to train in a fraction
of a second.

    CASES            name -> Case(model class name, constructor kwargs, make_inputs(seed))
    build(name)      (model in float32, train mode, no checkpointing yet; its forward kwargs)
    loss_and_grads   one forward (the loss: the mean square of every output that requires grad)
                     and backward
    NOT_RUN          name -> why a class is not in CASES

Most constructor and input values are in diffusers_cases.json (by class; input specs below);
the classes below them are written here.
"""
import dataclasses
import json
from pathlib import Path
from typing import Callable, NamedTuple

import torch


class Case(NamedTuple):
    cls: str
    init: dict
    make_inputs: Callable


# ---- inputs from specs: ["randn", shape, dtype] | ["tensor", values, dtype] | ["full", shape, value,
# dtype] | ["randint", shape, low, high, dtype] | ["lit", value] | ["list"|"tuple", [specs]] | ["dict", {k: spec}]

def _made(spec, g):
    kind = spec[0]
    if kind == "lit":
        return spec[1]
    if kind == "tensor":
        return torch.tensor(spec[1], dtype=getattr(torch, spec[2]))
    if kind == "full":
        return torch.full(spec[1], spec[2], dtype=getattr(torch, spec[3]))
    if kind == "randn":
        return torch.randn(spec[1], generator=g, dtype=getattr(torch, spec[2]))
    if kind == "randint":
        return torch.randint(spec[2], spec[3], spec[1], generator=g, dtype=getattr(torch, spec[4]))
    if kind == "dict":  # (JSON keys are strings: integer keys come back as ints)
        return {int(k) if k.isdigit() else k: _made(v, g) for k, v in spec[1].items()}
    if kind in ("list", "tuple"):
        items = [_made(v, g) for v in spec[1]]
        return items if kind == "list" else tuple(items)
    raise ValueError(f"an input spec of unknown kind {spec!r}")


def _from_specs(name, entry):
    def make_inputs(seed=0):
        g = torch.Generator().manual_seed(seed)
        inputs = {k: _made(v, g) for k, v in entry["inputs"].items() if v[0] != "unsupported"}
        if name == "WanAnimate2Transformer3DModel":  # its key/value cache, one per block
            from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache
            inputs["kv_cache"] = WanAnimate2KVCache(entry["init"]["num_layers"])
        return inputs
    return make_inputs


# ---- the classes written here ------------------------------------------------------------------

def _randn(g, *shape):
    return torch.randn(*shape, generator=g)


def _written(init, inputs):
    return lambda name: Case(name, init, lambda seed=0: inputs(torch.Generator().manual_seed(seed)))


def _flux3_inputs(g):
    image = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), torch.zeros(1),
                                       indexing="ij"), -1).reshape(-1, 4)
    text = torch.zeros(6, 4)
    text[:, 3] = torch.arange(6.0)
    # With an image condition: its blocks (mode_blocks["image_cond"]) run only when one is given.
    return dict(hidden_states=_randn(g, 1, 16, 8), encoder_hidden_states=_randn(g, 1, 6, 16),
                timestep=torch.tensor([0.5]), img_ids=image, txt_ids=text,
                image_cond_hidden_states=_randn(g, 1, 16, 8), image_cond_ids=image.clone())


def _qwen21_inputs(g):
    text, h, w = 6, 4, 4
    image_mask = torch.zeros(1, text + h * w // 4, dtype=torch.bool)
    image_mask[:, text:] = True
    return dict(hidden_states=_randn(g, 1, h * w, 8), encoder_hidden_states=_randn(g, 1, text, 16),
                timestep=torch.tensor([0.5]), img_shapes=[[(1, h, w)]], img_mask=image_mask)


def _stable_audio_inputs(g):
    from diffusers.models.embeddings import get_1d_rotary_pos_embed
    rotary = get_1d_rotary_pos_embed(4, 9, use_real=True, repeat_interleave_real=False)
    return dict(hidden_states=_randn(g, 1, 3, 8), timestep=torch.tensor([10.0]),
                encoder_hidden_states=_randn(g, 1, 5, 4), global_hidden_states=_randn(g, 1, 1, 8),
                rotary_embedding=rotary)


def _rfd4_inputs(g):
    n = 6
    return dict(bb_ca=_randn(g, 1, n, 3), local_latents=_randn(g, 1, n, 4), bb_ca_time=torch.tensor([0.5]),
                local_latents_time=torch.tensor([0.5]), padding_mask=torch.ones(1, n, dtype=torch.bool),
                conditioning={"is_in_context_conditioning": torch.zeros(1, n, dtype=torch.bool),
                              "supports_local_latent": torch.ones(1, n, dtype=torch.bool)})


def _image_2d(g):
    return dict(hidden_states=_randn(g, 1, 4, 4, 4), encoder_hidden_states=_randn(g, 1, 5, 16))


WRITTEN = {
    "StableCascadeUNet": _written(
        dict(conditioning_dim=32, block_out_channels=(32, 32), num_attention_heads=(2, 2),
             down_num_layers_per_block=(1, 1), up_num_layers_per_block=(1, 1), switch_level=(False,),
             clip_image_in_channels=16, clip_text_in_channels=16, clip_text_pooled_in_channels=16, clip_seq=2),
        lambda g: dict(sample=_randn(g, 1, 16, 4, 4), timestep_ratio=torch.tensor([0.5]),
                       clip_text_pooled=_randn(g, 1, 1, 16), clip_text=_randn(g, 1, 5, 16),
                       clip_img=_randn(g, 1, 1, 16))),
    "AnimaTextConditioner": _written(
        dict(source_dim=16, target_dim=16, model_dim=32, num_layers=2, num_attention_heads=2, target_vocab_size=20,
             min_sequence_length=4),
        lambda g: dict(source_hidden_states=_randn(g, 1, 6, 16),
                       target_input_ids=torch.randint(0, 20, (1, 4), generator=g))),
    "StableAudioDiTModel": _written(
        dict(sample_size=8, in_channels=3, num_layers=2, attention_head_dim=8, num_attention_heads=2,
             num_key_value_attention_heads=1, out_channels=3, cross_attention_dim=4, time_proj_dim=8,
             global_states_input_dim=8, cross_attention_input_dim=4), _stable_audio_inputs),
    "Transformer2DModel": _written(
        dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, norm_num_groups=1, cross_attention_dim=16,
             num_layers=2), _image_2d),
    "DreamLiteTransformer2DModel": _written(
        dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, norm_num_groups=1, cross_attention_dim=16,
             num_layers=2), _image_2d),
    "BriaFibo2Transformer2DModel": _written(
        dict(in_channels=4, patch_size=2, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2, cap_feat_dim=16,
             injection_layer_ids=(1,), perceiver_num_layers=1, min_num_gist_tokens=4, max_num_gist_tokens=8,
             gist_step=4, gist_min_text_len=4, gist_max_text_len=16, axes_dims=(4, 6, 6), axes_lens=(64, 16, 16)),
        lambda g: dict(hidden_states=_randn(g, 1, 4, 4, 4), timestep=torch.tensor([0.5]),
                       encoder_hidden_states=_randn(g, 1, 2, 8, 16))),
    "Flux3Transformer2DModel": _written(
        dict(in_channels=8, cond_in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=16,
             num_attention_heads=2, joint_attention_dim=16, timestep_channels=32, axes_dims_rope=(4, 4, 4, 4)),
        _flux3_inputs),
    "HunyuanImageTransformer2DModel": _written(
        dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
             num_single_layers=1, num_refiner_layers=1, patch_size=(1, 1), text_embed_dim=32, rope_axes_dim=(4, 4)),
        lambda g: dict(hidden_states=_randn(g, 1, 4, 4, 4), timestep=torch.tensor([10.0]),
                       encoder_hidden_states=_randn(g, 1, 6, 32),
                       encoder_attention_mask=torch.ones(1, 6, dtype=torch.bool))),
    "Kandinsky5Transformer3DModel": _written(
        dict(in_visual_dim=16, in_text_dim=16, in_text_dim2=8, time_dim=16, out_visual_dim=16, patch_size=(1, 2, 2),
             model_dim=16, ff_dim=32, num_text_blocks=1, num_visual_blocks=2, axes_dims=(1, 1, 2), visual_cond=False,
             attention_type="regular"),
        lambda g: dict(hidden_states=_randn(g, 1, 1, 4, 4, 16), encoder_hidden_states=_randn(g, 1, 6, 16),
                       timestep=torch.tensor([10.0]), pooled_projections=_randn(g, 1, 8),
                       visual_rope_pos=[torch.arange(1), torch.arange(2), torch.arange(2)],
                       text_rope_pos=torch.arange(6))),
    "Kandinsky6Transformer3DModel": _written(
        dict(in_visual_dim=4, out_visual_dim=4, in_text_dim=16, in_text_dim2=8, time_dim=32, patch_size=(1, 2, 2),
             model_dim=32, ff_dim=64, num_text_blocks=1, num_visual_blocks=1, axes_dims=(4, 6, 6), visual_cond=False,
             in_audio_dim=4, out_audio_dim=4),
        lambda g: dict(hidden_states=_randn(g, 1, 1, 4, 4, 4), encoder_hidden_states=_randn(g, 1, 6, 16),
                       pooled_projections=_randn(g, 1, 8), timestep=torch.tensor([10.0]))),
    "QwenImage21Transformer2DModel": _written(
        dict(patch_size=1, in_channels=8, out_channels=8, num_layers=2, attention_head_dim=16, num_attention_heads=2,
             context_in_dim=16, axes_dims_rope=(4, 6, 6)), _qwen21_inputs),
    "RFD4ProteinaTransformer": _written(
        dict(nlayers=2, token_dim=32, nheads=2, dim_cond=16, pair_repr_dim=8, latent_dim=4, token_type_emb_dim=4,
             cath_emb_dim=4, t_emb_dim=16, seq_sep_dim=8, xt_pair_dist_dim=8, feats_seq=("xt_bb_ca", "xt_local_latents"),
             feats_cond_seq=("time_emb_bb_ca", "time_emb_local_latents"), feats_pair_repr=("xt_bb_ca_pair_dists",),
             feats_pair_cond=("time_emb_bb_ca",), update_pair_repr_every_n=1, tri_mult_c=8), _rfd4_inputs),
    "SanaWMTransformer3DModel": _written(
        dict(in_channels=4, num_layers=2, hidden_size=32, num_attention_heads=2, softmax_every_n=2, linear_head_dim=16,
             caption_channels=16, use_chunk_plucker_post_attn=False, chunk_plucker_post_attn_blocks=0, image_size=8,
             mixed_precision="fp32"),
        lambda g: dict(hidden_states=_randn(g, 1, 4, 2, 4, 4), timestep=torch.full((1, 1, 2), 10.0),
                       encoder_hidden_states=_randn(g, 1, 1, 6, 16), mask=torch.ones(1, 6, dtype=torch.long))),
    "UNet2DConditionModel": _written(
        dict(block_out_channels=(4, 8), norm_num_groups=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
             up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=8, attention_head_dim=2,
             out_channels=4, in_channels=4, layers_per_block=1, sample_size=16),
        lambda g: dict(sample=_randn(g, 1, 4, 16, 16), timestep=torch.tensor([10]),
                       encoder_hidden_states=_randn(g, 1, 4, 8))),
}

# ControlNets: their transformer's kwargs (those the ControlNet takes) and inputs, and a condition.
CONTROLNETS = {"FluxControlNetModel": ("FluxTransformer2DModel", lambda inputs, g: _randn(g, 1, 16, 4)),
               "SD3ControlNetModel": ("SD3Transformer2DModel", None),
               "SanaControlNetModel": ("SanaTransformer2DModel", None),
               "QwenImageControlNetModel": ("QwenImageTransformer2DModel", None)}

NOT_RUN = {
    "CosmosControlNetModel": "its forward calls torchvision's transforms, and torchvision does not run next to the "
                             "CPU torch of the test environment",
    "UVit2DModel": "its gradient checkpointing fails without attnstash (it calls its checkpointed layers with keyword "
                   "arguments the checkpoint does not pass)",
    "AnyFlowFARTransformer3DModel": "its training forward uses FlexAttention, which has no backward on CPU",
    "Kandinsky6SRTransformer3DModel": "its attention is FlexAttention, which has no backward on CPU",
}


def _class(name):
    import diffusers
    if name == "AnimaTextConditioner":
        from diffusers.models.condition_embedders.condition_embedder_anima import AnimaTextConditioner
        return AnimaTextConditioner
    return getattr(diffusers, name.split("@")[0])


def _controlnet(name, transformer, condition):
    import inspect
    base = CASES[transformer]
    accepted = inspect.signature(_class(name).__init__).parameters
    init = {k: v for k, v in base.init.items() if k in accepted}

    def make_inputs(seed=0):
        inputs = base.make_inputs(seed)
        g = torch.Generator().manual_seed(seed + 1000)
        inputs["controlnet_cond"] = (condition(inputs, g) if condition is not None else
                                     _randn(g, *inputs["hidden_states"].shape))
        return inputs
    return Case(name, init, make_inputs)


def _cases():
    cases = {}
    for name, entry in json.loads((Path(__file__).with_name("diffusers_cases.json")).read_text()).items():
        if name.split("@")[0] not in NOT_RUN:
            cases[name] = Case(name, entry["init"], _from_specs(name, entry))
    for name, make in WRITTEN.items():
        cases[name] = make(name)
    return cases


CASES = _cases()
for _name, (_transformer, _condition) in CONTROLNETS.items():
    CASES[_name] = _controlnet(_name, _transformer, _condition)
CASES = dict(sorted(CASES.items()))


def build(name, seed=0):
    """(model, forward kwargs): float32, train mode, random weights from `seed`."""
    case = CASES[name]
    torch.manual_seed(seed)
    model = _class(case.cls)(**case.init).train()
    return model, case.make_inputs(seed)


def checkpoint_function(reentrant):
    """A diffusers checkpoint function in the given mode (diffusers' default is non-reentrant), that
    also passes keyword arguments (two models call their blocks with them)."""
    def checkpoint(module, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(module.__call__, *args, use_reentrant=reentrant, **kwargs)
    return checkpoint


def _outputs(o, out):
    if isinstance(o, torch.Tensor):
        if o.requires_grad and o.is_floating_point():
            out.append(o)
    elif isinstance(o, dict):
        for v in o.values():
            _outputs(v, out)
    elif isinstance(o, (list, tuple)):
        for v in o:
            _outputs(v, out)
    elif dataclasses.is_dataclass(o):
        for f in dataclasses.fields(o):
            _outputs(getattr(o, f.name), out)
    return out


def loss_and_grads(model, inputs, seed=7):
    """One forward and backward (the random state fixed first): (loss, {name: grad})."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = sum(t.float().pow(2).mean() for t in _outputs(model(**inputs), []))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
