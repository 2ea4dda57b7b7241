"""One completion on the engine, answered as JSON or as a server-sent event stream (the body of both
completion routes, routes.py): sampling parameters and KV coordinates are parsed and checked, the request is
admitted (503 past the limit), run, and its output rendered (render.py)."""

from __future__ import annotations

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from pdserve.auth import AuthError
from pdserve.engine.client import AddRequest
from pdserve.engine.outputs import RequestOutput
from pdserve.http_timeline import events_of, mark
from pdserve.kv.params import KVParamsError, PullSource, RemoteDecode
from pdserve.openai_request import SamplingFields
from pdserve.prompt_pack import TokenArray
from pdserve.server.prepare import check_output_fits, sampling_params
from pdserve.server.protocol import ApiError
from pdserve.server.refusal import EdgeRefusal
from pdserve.server.render import Kind, Renderer
from pdserve.server.state import ServerState
from pdserve.server.streams import RequestRun
from pdserve.web import REQUEST_ID_HEADER, client_request_id, error_response


async def answer(
    state: ServerState,
    kind: Kind,
    body: SamplingFields,
    model: str,
    prompt_ids: list[int] | TokenArray,
    default_max_tokens: int | None,
    request: Request,
    edge: EdgeRefusal,
) -> Response:
    """Run one request on the engine and answer it, streaming or not (refused before the engine has it: `edge`
    gives its transfer coordinates back)."""
    mark(request, "prompt_ready")
    engine = state.engine
    params = sampling_params(body, len(prompt_ids), engine.info.max_model_len, default_max_tokens)
    request_id = state.new_request_id()
    client_id = client_request_id(request.headers.get(REQUEST_ID_HEADER))
    state.edge.add(request_id, client_id, events_of(request))  # GET /timeline merges them with the engine's
    try:
        kv_params = edge.kv_params()  # parsed once, at the edge; typed from now on
    except KVParamsError as e:
        raise ApiError(400, str(e)) from e
    if isinstance(kv_params, RemoteDecode) and kv_params.decode_max_tokens is not None:
        check_output_fits(len(prompt_ids), kv_params.decode_max_tokens, engine.info.max_model_len)
    try:  # before anything is allocated or dialed: coordinates must have been issued for this prompt
        state.kv_auth.check(kv_params, prompt_ids, engine.info.kv_transfer_info)
    except AuthError as e:
        raise ApiError(403, str(e)) from e
    edge.capability_used = True  # (with a secret) used up by this request: giving it back is this request's
    if isinstance(kv_params, PullSource) and kv_params.num_tokens < len(prompt_ids) - 1:
        # D computes the last prompt token itself and receives the KV of all the others
        raise ApiError(
            400,
            f"kv_transfer_params name KV for {kv_params.num_tokens} tokens; a prompt of {len(prompt_ids)} tokens "
            f"needs {len(prompt_ids) - 1} (send the prompt the prefill instance computed)",
        )
    ids = prompt_ids if isinstance(prompt_ids, np.ndarray) else tuple(prompt_ids)  # both immutable
    command = AddRequest(request_id, ids, params, kv_params, client_id)
    run = RequestRun(engine, command, request, state.limits.max_queue_wait_s)  # runs nothing until first()
    renderer = Renderer(kind, request_id, model, prompt_ids, body.return_token_ids, body.include_usage)
    headers = {REQUEST_ID_HEADER: client_id or request_id}
    state.admit()  # 503 when full; from here to the `try` nothing raises, so the slot is always given back
    run.on_close = state.release
    edge.engine_has_it = True  # from here its refusal (generate() validates first) or abort is the engine's to report
    handed_over = False  # True once a streaming response owns `run` (it closes it)
    try:
        mark(request, "admitted")
        first = await run.first()  # bad input surfaces here, before any byte of the answer is sent
        if first is not None and first.finish_reason == "error" and not first.token_ids:
            return _failed(run, first)  # failed before its first token (its KV never came): a status, not a stream
        if body.stream:
            events = renderer.events(run, first)
            handed_over = True
            return StreamingResponse(
                events, media_type="text/event-stream", headers=headers, background=BackgroundTask(run.close)
            )
        out = await run.final()
        mark(request, "answer_ready")
        if out is not None and out.finish_reason == "abort" and out.released:
            # the router released this prefill (POST /kv_transfer/release: its client or decode leg is gone) and
            # may close this connection at the same moment: a 499 either way, whichever P notices first
            run.status = 499
            return error_response(
                499, f"request {request_id} was released (POST /kv_transfer/release) before its prefill finished"
            )
        if out is None or not out.finished or out.finish_reason in ("error", "abort"):
            return _failed(run, out)
        response = JSONResponse(renderer.response(out), headers=headers)
        mark(request, "answer_encoded")
        return response
    finally:
        if not handed_over:
            await run.close()


def _failed(run: RequestRun, out: RequestOutput | None) -> Response:
    """The error answer of a request the engine ended with an error or an abort: a 400 when the error is the
    request's own (kv_transfer_params naming KV its producer does not hold: stale, forged or replayed), else 500."""
    run.status = 400 if out is not None and out.client_error else 500
    message = (out.error if out is not None else None) or f"request {run.request_id} was aborted by the engine"
    if run.status == 400:
        message = f"invalid kv_transfer_params: {message}"
    return error_response(run.status, message)
