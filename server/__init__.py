"""The aiohttp server (OpenAI-compatible API, native /generate, websocket) and the `ppserve` CLI."""
