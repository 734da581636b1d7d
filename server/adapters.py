"""LoRA adapters loaded and unloaded while the server runs (vLLM's runtime LoRA routes), when
it was started with --allow-runtime-lora-updating (else both answer 404 saying so): ``POST
/v1/load_lora_adapter`` with ``{"lora_name", "lora_path"}`` (a directory on the server's
machine) and ``POST /v1/unload_lora_adapter`` with ``{"lora_name"}``. A loaded adapter is a
model requests name; requests already running on an unloaded one finish."""
from __future__ import annotations

import asyncio

from aiohttp import web

from tandem.server.app import STATE, read_json, ready_engine
from tandem.server.config import ServerConfig
from tandem.server.errors import ApiError, bad_request


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/load_lora_adapter", load)
    app.router.add_post("/v1/unload_lora_adapter", unload)


def check_name(name: str, cfg: ServerConfig) -> str:
    """An adapter's name, if it names no served model (ValueError else)."""
    if name == cfg.served_model_name or name in cfg.model_aliases:
        raise ValueError(f"lora_name: {name!r} is the served model's name")
    return name


def _string(body: dict, key: str) -> str:
    v = body.get(key)
    if not isinstance(v, str) or not v:
        raise bad_request(f"{key}: must be a non-empty string", param=key)
    return v


def _allowed(request) -> None:
    if not request.app[STATE].cfg.runtime_lora:
        raise ApiError(404, "loading and unloading LoRA adapters while the server runs is off: start it with "
                            "--allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)",
                       code="runtime_lora_off")


async def load(request):
    _allowed(request)
    engine = ready_engine(request)
    body = await read_json(request)
    cfg = request.app[STATE].cfg
    name, path = _string(body, "lora_name"), _string(body, "lora_path")
    try:
        check_name(name, cfg)
    except ValueError as e:
        raise bad_request(str(e), param="lora_name") from None
    if name in engine.llm.adapters:
        raise bad_request(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
    try:      # reads the adapter's files: off the event loop
        await asyncio.get_running_loop().run_in_executor(None, engine.llm.load_lora, name, path)
    except ValueError as e:
        raise bad_request(str(e), param="lora_path") from None
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload(request):
    _allowed(request)
    engine = ready_engine(request)
    body = await read_json(request)
    name = _string(body, "lora_name")
    if not engine.llm.unload_lora(name):
        raise ApiError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                       code="model_not_found")
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
