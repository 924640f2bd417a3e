"""OpenAI-compatible HTTP API served by `moaspec serve`, decoding speculatively on the server.

Modules: routes (handlers, the step-by-step generation loop, registration on the split server's
aiohttp app), validation (requests -> generation jobs, pydantic), schemas (response bodies),
streaming (stop sequences, server-sent events), queue (bounded admission queue, 429 when full),
metrics (Prometheus, prometheus_client), cli (the serve flags). OpenAI's error shape, used by
every route of `moaspec serve`, and the other HTTP pieces both APIs share are in moaspec/serving.
"""
