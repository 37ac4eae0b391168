"""The router's HTTP wing: TGI's routes (tgi_api.py) and OpenAI's (openai_api.py, openai_render.py,
chat.py, tools.py) over the shared request state (state.py), request validation (validation.py,
grammar_check.py), one error shape (errors.py), access control (access.py), metrics and tracing."""
