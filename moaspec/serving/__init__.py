"""HTTP pieces both APIs of `moaspec serve` share: the split protocol (moaspec/split) and the
OpenAI-compatible API (moaspec/openai_api), which never imports the split package.

Modules: errors (OpenAI's error shape, used by every route), strict_json (strict JSON bodies,
`ProtocolError`), http_body (reading a body in bounded time and size), http_guard (connection
count, header and keep-alive time-outs, malformed HTTP), limits (server limits, free of heavy
imports for the CLI), identity (the drafter's name and weight fingerprint).
"""
