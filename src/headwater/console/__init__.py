"""The operator console: every part of headwater on one site, served by ``headwater up`` and
by ``headwater console``.

Server-rendered pages (Jinja2, autoescaped) with one small script (the live tail over
server-sent events, confirmations); charts are SVG drawn on the server from the series the
process keeps in memory for the last hour. Every page and action needs a session that an admin
token opened (``console.admin_token_hashes``); actions are POSTs carrying the session's CSRF
token, from the console's own origin.
"""
