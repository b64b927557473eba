"""The Tinker wire format, both ways, on the SDK's own types: its protobuf messages (``tinker.proto.tinker_public_pb2``)
and its pydantic request/response models (``tinker.types``). Nothing here re-declares them.

In: ``forward_backward`` bodies are a protobuf ``ForwardBackwardRequest`` (zstd-compressed when the client says
``Content-Encoding: zstd``); every other request is JSON, parsed by the SDK's request model. Out: a
``ForwardBackwardOutput`` or ``SampleResponse`` result goes back as protobuf when the client asks for it (``Accept:
application/x-protobuf``, as the SDK always does for those two), else as the equivalent JSON.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from opentinker.agents.adapter_trainer import AdamStep, ForwardResult, TokenDatum
from opentinker.agents.lm_sampler import SampleJob, SampleResult, SamplingSpec

from .stability import Provenance, Span

PROTOBUF = "application/x-protobuf"
_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
_STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


class WireError(ValueError):
    """A request body that does not decode: the message names the field."""


@dataclass(frozen=True)
class ForwardBackwardCall:
    """A decoded ``forward_backward`` (or ``forward``) request."""

    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[TokenDatum]
    provenance: list[Provenance | None]
    """Per datum: the runs naming the sampled sequences its tokens come from (``Datum.with_provenance``), if any."""


def decode_forward_backward(body: bytes, content_encoding: str | None = None) -> ForwardBackwardCall:
    if content_encoding and content_encoding.lower() == "zstd":
        import zstandard

        try:
            body = zstandard.ZstdDecompressor().decompress(body, max_output_size=1 << 31)
        except zstandard.ZstdError as error:
            raise WireError(f"body: not valid zstd ({error})") from error
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception as error:  # protobuf raises DecodeError (and RuntimeWarning-ish subclasses) on garbage
        raise WireError(f"body: not a tinker ForwardBackwardRequest protobuf ({type(error).__name__})") from error
    if not message.model_id:
        raise WireError("model_id: required")
    config: dict[str, float | str] = dict(message.loss_fn_config.items())
    for key, value in message.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else value.number
    data = [_datum(i, datum) for i, datum in enumerate(message.data)]
    provenance = [_provenance(datum) for datum in message.data]
    return ForwardBackwardCall(
        message.model_id, int(message.seq_id), message.loss_fn, config, bool(message.forward_only), data, provenance
    )


def _provenance(datum: pb.Datum) -> Provenance | None:
    if not datum.model_input_spans and not datum.loss_fn_input_spans:
        return None
    return Provenance(_spans(datum.model_input_spans), _spans(datum.loss_fn_input_spans))


def _spans(spans) -> tuple[Span, ...]:
    runs = []
    for span in spans:
        kind = span.WhichOneof("span")
        arm = span.sampled_tokens if kind == "sampled_tokens" else span.prompt_tokens
        runs.append(Span(kind == "sampled_tokens", arm.sequence_id, int(arm.offset), int(arm.length)))
    return tuple(runs)


def _datum(index: int, datum: pb.Datum) -> TokenDatum:
    tokens: list[int] = []
    for chunk in datum.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise WireError(f"data[{index}].model_input: {kind or 'empty'} chunks are not supported (text models only)")
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise WireError(f"data[{index}].model_input: token bytes are not int32")
        tokens += np.frombuffer(raw, dtype=np.int32).tolist()
    inputs = {name: _tensor(f"data[{index}].loss_fn_inputs[{name!r}]", t) for name, t in datum.loss_fn_inputs.items()}
    return TokenDatum(tokens, inputs)


def _tensor(field: str, tensor: pb.Tensor) -> np.ndarray:
    """A public proto ``Tensor`` as a dense numpy array (a sparse CSR one densified with zeros)."""
    dtype = _DTYPES.get(tensor.dtype)
    if dtype is None:
        raise WireError(f"{field}: unsupported dtype {tensor.dtype}")
    shape = tuple(tensor.shape)
    try:
        if tensor.WhichOneof("encoding") == "sparse_csr":
            csr = tensor.sparse_csr
            values = np.frombuffer(csr.values, dtype=dtype)
            crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
            col = np.frombuffer(csr.col_indices, dtype=np.int64)
            if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values) or crow[-1] != len(values):
                raise WireError(f"{field}: inconsistent sparse CSR tensor")
            dense = np.zeros(shape, dtype=dtype)
            rows = np.repeat(np.arange(shape[0]), np.diff(crow))
            dense[rows, col] = values
            return dense
        values = np.frombuffer(tensor.dense, dtype=dtype).copy()  # writable: torch refuses read-only buffers
        return values.reshape(shape) if shape else values
    except (ValueError, IndexError) as error:
        raise WireError(
            f"{field}: {len(tensor.dense)} bytes do not make a {dtype.__name__} tensor of shape {shape}"
        ) from error


def adam_step(request: types.OptimStepRequest) -> AdamStep:
    params = request.optim_params
    if not isinstance(params, types.AdamParams):
        raise WireError(f"optim_params: only AdamW is supported, got the {getattr(params, 'type', '?')!r} optimizer")
    return AdamStep(**params.model_dump())


def sampling_spec(params: types.SamplingParams) -> SamplingSpec:
    """Tinker's ``SamplingParams``: ``stop`` may be a string, strings or token ids, each ending a row besides the
    end-of-text tokens; ``[]`` disables every stop, end-of-text included."""
    stop = params.stop
    tokens: tuple[int, ...] = ()
    strings: tuple[str, ...] = ()
    if isinstance(stop, str):
        strings = (stop,)
    elif stop is not None:
        values = list(stop)
        if all(isinstance(v, str) for v in values):
            strings = tuple(values)
        elif all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            tokens = tuple(values)
        else:
            raise WireError("sampling_params.stop: expected a string, a list of strings or a list of token ids")
    if params.max_tokens is None:
        raise WireError("sampling_params.max_tokens: required")
    return SamplingSpec(
        max_tokens=params.max_tokens,
        temperature=float(params.temperature),
        top_k=int(params.top_k),
        top_p=float(params.top_p),
        seed=params.seed,
        stop_tokens=tokens,
        stop_strings=strings,
        stop_at_eos=stop is None or len(stop) > 0,
    )


def sample_job(request: types.SampleRequest, adapter: str | None) -> SampleJob:
    unsupported = {
        "target_prompt_logprobs": request.target_prompt_logprobs is not None,
        "prompt_alt_tokens_k": request.prompt_alt_tokens_k > 0,
        "prompt_logprobs_last_n": request.prompt_logprobs_last_n is not None,
    }
    for name, asked in unsupported.items():
        if asked:
            raise WireError(f"{name}: not supported by this server")
    try:
        prompt = request.prompt.to_ints()
    except ValueError as error:
        raise WireError("prompt: only token (encoded_text) chunks are supported (text models only)") from error
    return SampleJob(
        prompt=prompt,
        num_samples=request.num_samples,
        spec=sampling_spec(request.sampling_params),
        adapter=adapter,
        prompt_logprobs=bool(request.prompt_logprobs),
        topk_prompt=request.topk_prompt_logprobs,
        topk_sample=request.topk_sample_logprobs,
    )


# -- results -----------------------------------------------------------------------------------------------------
def forward_backward_proto(result: ForwardResult, metrics: dict[str, float]) -> bytes:
    """``ForwardBackwardOutput``: each datum's ``logprobs``, batched in runs of equal trailing shape."""
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    runs: list[list[np.ndarray]] = []
    for logprobs in result.logprobs:
        if runs and runs[-1][0].shape[1:] == logprobs.shape[1:]:
            runs[-1].append(logprobs)
        else:
            runs.append([logprobs])
    for run in runs:
        arrays = [np.ascontiguousarray(a, dtype=np.float32) for a in run]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        batched = pb.BatchedTensor(
            data=b"".join(a.tobytes() for a in arrays),
            offsets=offsets.tobytes(),
            dtype=pb.DTYPE_FLOAT32,
            trailing_shape=list(run[0].shape[1:]),
        )
        out.loss_fn_outputs.append(
            pb.ArrayRecord(type_tag="ArrayRecord", fields={"logprobs": batched}, num_datums=len(run))
        )
    return out.SerializeToString()


def forward_backward_json(result: ForwardResult, metrics: dict[str, float]) -> dict[str, Any]:
    outputs = [
        {"logprobs": {"data": lp.ravel().tolist(), "dtype": "float32", "shape": list(lp.shape)}}
        for lp in result.logprobs
    ]
    return {"loss_fn_output_type": "ArrayRecord", "loss_fn_outputs": outputs, "metrics": metrics}


def sample_proto(result: SampleResult) -> bytes:
    out = pb.SampleResponse()
    for completion in result.completions:
        sequence = out.sequences.add(
            stop_reason=_STOP_REASONS[completion.stop_reason],
            tokens=np.asarray(completion.tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(completion.logprobs, dtype=np.float32).tobytes(),
        )
        if completion.topk:
            ids = np.asarray([ids for ids, _ in completion.topk], dtype=np.int32)
            values = np.asarray([values for _, values in completion.topk], dtype=np.float32)
            sequence.topk_sampled_logprobs.CopyFrom(_topk(ids, values))
    if result.prompt_logprobs is not None:
        out.prompt_logprobs = result.prompt_logprobs.astype(np.float32).tobytes()
    if result.prompt_topk is not None:
        out.topk_prompt_logprobs.CopyFrom(_topk(*result.prompt_topk))
    return out.SerializeToString()


def _topk(ids: np.ndarray, values: np.ndarray) -> pb.TopkLogprobs:
    return pb.TopkLogprobs(
        token_ids=ids.astype(np.int32).tobytes(),
        logprobs=values.astype(np.float32).tobytes(),
        k=int(ids.shape[1]),
        length=int(ids.shape[0]),
    )


def sample_json(result: SampleResult) -> dict[str, Any]:
    sequences = [{"stop_reason": c.stop_reason, "tokens": c.tokens, "logprobs": c.logprobs} for c in result.completions]
    prompt = None
    if result.prompt_logprobs is not None:
        prompt = [None if np.isnan(v) else float(v) for v in result.prompt_logprobs]
    return {"type": "sample", "sequences": sequences, "prompt_logprobs": prompt}
