"""Does tunix run the same SmolLM2 as jaxflash? Next-token distributions side by side.

    python benchmarks/tunix_rope_check.py      # needs e2e_vs_tunix.py's export and tunix venv

One sequence (the first two rendered train prompts of ``e2e_vs_tunix.py``'s task, end to
end: 92 tokens), scored in one forward pass by jaxflash's decoder (the exported
safetensors through ``load_hf``) and by tunix 0.1.7's Llama 3 model (the same file
through its own loader, in its venv) twice: with tunix's own RoPE (its attention calls
``apply_rope`` without ``rope_theta``: base 1e6) and with the checkpoint's base
(SmolLM2: 1e5; ``tunix_e2e_worker.use_rope_theta``). Prints per tunix variant the mean
and max over positions of KL(jaxflash || tunix) of the next-token distributions (nats),
the max |log p| difference, and how often the argmax agrees.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


def main() -> dict:
    import e2e_vs_tunix as e2e
    import jax
    import numpy as np

    from jaxflash.models.decoder.logprobs import logits_from_hidden
    from jaxflash.models.decoder.transformer import forward, unembed
    from jaxflash.models.formats.weights_hf import load_hf

    cache = os.path.expanduser("~/.cache/jaxflash/bench")
    w = {"steps": 1, "prompts_per_step": 2, "group_size": 2, "lr": 2e-5, "eval_prompts": 2,
         "eval_samples": 1, "eval_every": 1, "max_new_tokens": 24, "template": "",
         "tiny": False, "hf_dir": os.path.join(cache, "smollm2_135m_hf"), "seed": 0}  # fmt: skip
    prep = e2e._prepare(w)
    ids = prep["train"][0]["ids"] + prep["train"][1]["ids"]
    config, params = load_hf(w["hf_dir"])
    x = np.asarray([ids], np.int32)
    h, _ = forward(params, config, x, np.arange(len(ids), dtype=np.int32)[None])
    ours = np.asarray(jax.nn.log_softmax(logits_from_hidden(h, unembed(params, config))[0], -1))
    python = os.path.join(cache, "tunix-0.1.7", "bin", "python")
    script = os.path.join(HERE, "tunix_e2e_worker.py")
    out = {}
    for rope in ("tunix", "config"):
        work = {**w, **prep, "kind": "logits", "rope": rope, "ids": ids}
        theirs = np.asarray(e2e.run_worker(python, script, work, 900.0)["logp"], np.float32)
        kl = (np.exp(ours) * (ours - theirs)).sum(-1)
        out[rope] = {
            "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "max_abs_logp_diff": float(np.abs(ours - theirs).max()),
            "argmax_agree": float((ours.argmax(-1) == theirs.argmax(-1)).mean()),
        }  # fmt: skip
        base = 1e6 if rope == "tunix" else float(config.rope_theta)
        print(f"tunix RoPE {rope} (base {base:g}) vs "
              f"jaxflash over {len(ids)} positions: KL mean {out[rope]['kl_mean']:.2e} max "
              f"{out[rope]['kl_max']:.2e} nats, max |dlogp| {out[rope]['max_abs_logp_diff']:.2e},"
              f" argmax agrees {out[rope]['argmax_agree']:.3f}", flush=True)  # fmt: skip
    return out


if __name__ == "__main__":
    main()
