"""The APIs agent harnesses speak besides chat completions, as thin translations onto it.

OpenAI's Responses API (`responses_request`, `responses_output`: the OpenAI Agents SDK's default)
and Anthropic's Messages API (`messages_request`, `messages_output`: Claude Code's) are turned
into a chat-completions body, served by the same chat path (renderers, tool and reasoning
parsers, grammars), and the chat answer or stream turned back. Everything here is pure: the
engine's and the router's routes (`dsv4_serve.agent_routes`, `dsv4_router.agent_routes`) are the
shells that read bodies and call the chat path; `edge` is the part both shells share.
"""
