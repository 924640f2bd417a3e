"""OpenAI-compatible HTTP API served by `moaspec serve`, decoding speculatively on the server.

Modules: routes (handlers, the step-by-step generation loop, registration on the split server's
aiohttp app), schemas (request validation, response and error bodies), streaming (stop sequences,
server-sent events), queue (bounded admission queue, 429 when full), metrics (Prometheus text).
"""
