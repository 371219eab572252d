"""The controller <-> generation-program messages: JSON headers + raw arrays, no pickle."""

import numpy as np
import pytest

from jaxflash.runtime.fleet import rpc_wire
from jaxflash.runtime.fleet.rpc_wire import Status, WeightOffer, WireError
from jaxflash.types import FinishReason, GenerationRequest, Sample, SamplingParams


def test_arrays_round_trip_bit_exact_including_bfloat16():
    import ml_dtypes

    rng = np.random.default_rng(0)
    arrays = {
        "f32": rng.standard_normal((3, 5)).astype(np.float32),
        "i32": np.arange(7, dtype=np.int32),
        "bf16": rng.standard_normal(4).astype(ml_dtypes.bfloat16),
        "empty": np.zeros((0, 2), np.int64),
    }
    header, out = rpc_wire.decode(rpc_wire.encode({"type": "x", "n": 3}, arrays))
    assert header == {"type": "x", "n": 3}
    for name, a in arrays.items():
        assert out[name].dtype == a.dtype and out[name].shape == a.shape, name
        assert out[name].tobytes() == a.tobytes(), name


def test_request_and_sample_round_trip():
    request = GenerationRequest(
        prompt_id=12,
        sample_index=3,
        prompt_tokens=np.array([1, 5, 9], np.int32),
        sampling=SamplingParams(temperature=0.7, top_k=5, max_new_tokens=4),
        seed=99,
    )
    back = rpc_wire.decode_request(rpc_wire.encode_request(request))
    assert (back.prompt_id, back.sample_index, back.seed) == (12, 3, 99)
    assert back.sampling == request.sampling
    np.testing.assert_array_equal(back.prompt_tokens, request.prompt_tokens)

    logp = np.array([-0.1, -2.3456789, -1e-7], np.float32)
    sample = Sample(
        prompt_id=12,
        sample_index=3,
        prompt_tokens=np.array([1, 5, 9], np.int32),
        response_tokens=np.array([4, 4, 2], np.int32),
        behaviour_logprobs=logp,
        token_versions=np.array([0, 0, 1], np.int32),
        finish_reason=FinishReason("eos"),
        start_version=0,
    )
    header, arrays = rpc_wire.decode(rpc_wire.encode(*rpc_wire.sample_message(sample)))
    got = rpc_wire.sample_from_message(header, arrays)
    assert got.behaviour_logprobs.tobytes() == logp.tobytes()  # logprobs travel bit for bit
    assert got.finish_reason == sample.finish_reason and got.start_version == 0
    np.testing.assert_array_equal(got.token_versions, sample.token_versions)


@pytest.mark.parametrize(
    "message, match",
    [
        (b"XXXX\x00\x00\x00\x02{}", "not a jaxflash message"),
        (b"JFR1\x00\x00\x01\x00{}", "header of 256 bytes"),
        (b"JFR1\x00\x00\x00\x03[1]", "not an object"),
        (b"JFR1\x00\x00\x00\x01{", "not JSON"),
    ],
)
def test_malformed_messages_are_refused_naming_the_fault(message, match):
    with pytest.raises(WireError, match=match):
        rpc_wire.decode(message)


def test_an_array_running_past_the_end_and_unknown_dtypes_are_refused():
    good = rpc_wire.encode({}, {"a": np.arange(4, dtype=np.int32)})
    with pytest.raises(WireError, match="runs past the end"):
        rpc_wire.decode(good[:-1])
    with pytest.raises(WireError, match="complex64"):
        rpc_wire.encode({}, {"c": np.zeros(2, np.complex64)})
    with pytest.raises(WireError, match="reserved"):
        rpc_wire.encode({"arrays": 1})
    with pytest.raises(WireError, match="not a generation request"):
        rpc_wire.decode_request(rpc_wire.encode({"prompt_id": 1}))


def test_replies_carry_a_status_enum_and_offers_round_trip():
    status, fields = rpc_wire.reply_status(rpc_wire.reply(Status.REJECTED, error="too long"))
    assert status is Status.REJECTED and fields == {"error": "too long"}
    with pytest.raises(WireError, match="known status"):
        rpc_wire.reply_status(rpc_wire.encode({"status": "maybe"}))
    offer = WeightOffer(version=4, senders=("127.0.0.1:5", "127.0.0.1:6"))
    assert WeightOffer.from_json(offer.to_json()) == offer
