"""Test setup: a fake 8-device CPU mesh, set before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# A persistent compilation cache shared by every test process (both pytest-xdist
# workers and the JAX programs tests start): much of the suite's time is XLA compiling
# the same programs again in each test and each resumed run. The cache key is the HLO
# plus compile options and devices, so a hit is the program XLA would have built. Kept
# under the checkout (.cache/, git-ignored; delete it to reclaim the space: a whole
# suite adds ~70 MB). No size cap on purpose: with one, jax scans and stats every entry
# at each write (O(entries) per compile), which made the small-program files 3-4x
# slower. Programs that compile in under 0.1 s are not worth a file.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(_REPO, ".cache", "jax-tests"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)


# Test files that run alone (``make test`` runs them after the rest, which runs on two
# pytest-xdist workers): they start several JAX processes of their own (so they already
# use every core), hold a fixed port, take most of the machine's memory (Gemma 3's
# learner, ~15 GB), or time sandboxed children against wall-clock limits.
SERIAL_FILES = frozenset(
    {
        "test_chaos_soak.py",
        "test_distributed.py",
        "test_gemma3_gguf.py",
        "test_gen_hosts_procs.py",
        "test_gen_processes.py",
        "test_gen_server.py",
        "test_kill_campaign.py",
        "test_learner_procs.py",
        "test_preemption_procs.py",
        "test_tool_env.py",
        "test_transfer_procs.py",
    }
)


def pytest_collection_modifyitems(config, items):
    """Mark every test of ``SERIAL_FILES`` ``serial``."""
    import pytest

    for item in items:
        if item.path.name in SERIAL_FILES:
            item.add_marker(pytest.mark.serial)
