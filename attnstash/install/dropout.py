"""Where an attention dropout that a stashed layer's call passed comes from, for the message
that refuses it (core.frame_error)."""
import itertools

import torch


def holder(dropout_p, traceback):
    """Where the attention dropout a refused call passed comes from, for its message: an
    attribute of the module that called attention (`self` or `module` of one of the innermost
    callers in the refusal's traceback) holding that value, a float or an nn.Dropout's p ("" if
    none is found)."""
    frames = []
    while traceback is not None:
        frames.append(traceback.tb_frame)
        traceback = traceback.tb_next
    try:
        for frame in reversed(frames[-8:]):
            for module in (frame.f_locals.get("self"), frame.f_locals.get("module")):
                if not isinstance(module, torch.nn.Module):
                    continue
                for name, value in itertools.chain(vars(module).items(), module._modules.items()):
                    p = value.p if isinstance(value, torch.nn.Dropout) else value
                    if "drop" in name and isinstance(p, float) and p == dropout_p:
                        attr = f"{name}.p" if isinstance(value, torch.nn.Dropout) else name
                        return (f" It comes from {type(module).__name__}.{attr} = {dropout_p} (the module that calls "
                                "attention): build the model with that dropout at 0.0 (its config's attention "
                                f"dropout field), or set {attr} = 0.0 on those modules before training.")
    finally:
        del frames
    return ""
