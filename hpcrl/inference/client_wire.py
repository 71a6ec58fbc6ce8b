"""SGLang's /generate and weight-update answers, read into hpcrl's types, with the checks on them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpcrl.inference.client_http import InferenceError
from hpcrl.inference.context import max_input_len


@dataclass(slots=True)
class GenerateResult:
    output_ids: list[int]  # the generated tokens, without the prompt
    logprobs: list[float]  # logprob of each output token under the sampling distribution; [] if not requested
    finish_reason: str  # "stop" | "length" | "abort" (meta_info.finish_reason.type)
    weight_version: str | int | None  # the server's weight version when it answered
    server: str  # host:port of the server that generated it
    meta_info: dict[str, Any]  # the server's meta_info as sent (token counts, latency, ...)


class ContextLengthError(InferenceError):
    """A request SGLang refuses for its length, refused before it is sent: prompt + ``max_new_tokens`` over the
    model's context, or a prompt within SGLang's margin of it (``context.fit``, ``context.max_input_len``).

    SGLang would answer HTTP 400 (what it says is ``context.fit``); the caller drops the prompt's group and
    counts it, or the client shortens ``max_new_tokens`` (``context_overflow="truncate"``) when SGLang takes
    the prompt itself. ``prompt_tokens``, ``max_new_tokens`` and ``context_length`` say by how much."""

    def __init__(self, prompt_tokens: int, max_new_tokens: int, context_length: int) -> None:
        total = prompt_tokens + max_new_tokens
        longest = max_input_len(context_length) - 1
        super().__init__(
            f"a prompt of {prompt_tokens} tokens with max_new_tokens={max_new_tokens} ({total} tokens) does not fit "
            f"the model's context length of {context_length} tokens (SGLang takes prompts of at most {longest} "
            "tokens, and prompt + max_new_tokens of at most the context); not sent (SGLang would answer HTTP 400)",
            server="",
            endpoint="/generate",
        )
        self.prompt_tokens, self.max_new_tokens, self.context_length = prompt_tokens, max_new_tokens, context_length


def check_sampling(sampling_params: dict[str, Any]) -> None:
    if sampling_params.get("max_new_tokens") is None:
        raise ValueError(
            "sampling_params must set max_new_tokens; the server would otherwise silently stop at its default "
            f"of 128 tokens. Got {sampling_params!r}"
        )
    if sampling_params.get("n", 1) != 1:
        raise ValueError(
            f"sampling_params n={sampling_params['n']} is not supported: the answer would be a list per prompt; "
            "send n separate requests (asyncio.gather) instead"
        )


def check_success(server: str, endpoint: str, answer: Any) -> None:
    if not isinstance(answer, dict) or answer.get("success") is not True:
        message = answer.get("message") if isinstance(answer, dict) else answer
        raise InferenceError(
            f"POST {endpoint} on {server} reported failure: {message}", server=server, endpoint=endpoint
        )


def parse_result(server: str, answer: Any, return_logprob: bool) -> GenerateResult:
    try:
        meta = answer["meta_info"]
        output_ids = [int(token) for token in answer["output_ids"]]
        finish = meta["finish_reason"]
        reason = finish["type"] if isinstance(finish, dict) else finish
        entries = meta["output_token_logprobs"] if return_logprob else []
        logprobs = [float(entry[0]) for entry in entries]
        logprob_ids = [int(entry[1]) for entry in entries]
    except (KeyError, IndexError, TypeError, ValueError) as error:
        raise InferenceError(
            f"POST /generate on {server} answered without the expected output_ids / meta_info fields "
            f"({type(error).__name__}: {error}): {str(answer)[:500]}",
            server=server,
            endpoint="/generate",
        ) from error
    if not isinstance(reason, str):
        raise InferenceError(
            f"POST /generate on {server} answered with finish_reason {finish!r}, expected a type", server=server
        )
    if return_logprob and logprob_ids != output_ids:
        # A shifted or truncated logprob list would silently corrupt the policy-gradient ratio.
        raise InferenceError(
            f"POST /generate on {server} answered {len(output_ids)} output_ids but output_token_logprobs for "
            f"tokens {logprob_ids[:8]}... ({len(logprob_ids)} entries) that do not match them",
            server=server,
            endpoint="/generate",
        )
    return GenerateResult(output_ids, logprobs, reason, meta.get("weight_version"), server, meta)
