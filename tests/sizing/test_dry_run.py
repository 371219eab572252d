"""sizing.dry_run: learner step and engine compiled for a mesh, nothing allocated."""

import math

import jax
import pytest

from jaxflash.generation.engine.state import EngineConfig
from jaxflash.learner.config import LearnerConfig
from jaxflash.models.config.presets import get_preset
from jaxflash.models.decoder.transformer import abstract_params
from jaxflash.sharding.mesh import make_mesh
from jaxflash.sharding.rules import GENERATOR_RULES, LEARNER_RULES
from jaxflash.sizing import dry_run, format_report


def test_dry_run_reports_per_device_memory_of_every_program():
    model = get_preset("tiny", n_layers=2)
    learner = LearnerConfig(lr=1e-3, micro_batch_size=4)
    engine = EngineConfig(max_concurrent_decodes=8, max_prefill_length=32, max_target_length=64)
    lmesh = make_mesh(jax.devices(), {"fsdp": 8})
    gmesh = make_mesh(jax.devices()[:2], {"tensor": 2})
    # By identity, not count: earlier tests' garbage may be freed meanwhile (the count
    # then drops although nothing was allocated; seen in the full fast tier).
    before = {id(a) for a in jax.live_arrays()}
    reports = dry_run(
        model, learner, engine,
        learner_mesh=lmesh, learner_rules=LEARNER_RULES,
        generation_mesh=gmesh, generation_rules=GENERATOR_RULES,
        batch_size=8, seq_len=64,
    )  # fmt: skip
    new = [a.shape for a in jax.live_arrays() if id(a) not in before]
    assert not new  # compiled only: nothing was allocated
    by = {r.name: r for r in reports}
    assert list(by) == ["train_step", "prefill", "generate"]
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params(model)))
    train = by["train_step"]
    # params + Adam mu + nu (float32), split 8 ways by fsdp where the dims divide:
    # at least a third of the unsharded size, at most all of it.
    state_bytes = 3 * 4 * n_params
    assert state_bytes / 8 <= train.argument_bytes <= state_bytes + (1 << 20)
    # The state is donated: every argument byte but the batch's is reused for outputs.
    # Batch: 7 fields of [2, 4, 64] 4-byte values, replicated (b=4 does not split 8 ways).
    batch_bytes = 7 * 8 * 64 * 4
    assert train.alias_bytes >= train.argument_bytes - batch_bytes - 64
    assert train.devices == 8 and by["generate"].devices == 2
    gen = by["generate"]
    kv_cache = 2 * model.n_layers * 8 * 64 * model.n_kv_heads * model.head_dim * 4 / 2
    assert gen.argument_bytes >= kv_cache  # params + the donated decode state
    assert gen.alias_bytes >= kv_cache
    for r in reports:
        assert r.peak_bytes >= r.argument_bytes > 0 and r.temp_bytes >= 0
    table = format_report(reports, title="tiny")
    assert table.splitlines()[0] == "tiny" and "train_step" in table and "generate" in table


def test_batch_must_split_into_micro_batches():
    from jaxflash.sizing.dry_run import compile_train_step

    with pytest.raises(ValueError, match="multiple of micro=4"):
        compile_train_step(
            get_preset("tiny"),
            LearnerConfig(lr=1e-3, micro_batch_size=4),
            make_mesh(jax.devices()[:1], {}),
            LEARNER_RULES,
            batch_size=6,
            seq_len=32,
        )
