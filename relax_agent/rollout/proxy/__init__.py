"""The policy endpoint of agent-driven rollouts (``rollout.driver: agent``): OpenAI Chat Completions,
OpenAI Responses and Anthropic Messages.

- :mod:`~relax_agent.rollout.proxy.openai_api`: the chat-completions wire format (request validation,
  bodies) and the internal chat request every API translates to;
- :mod:`~relax_agent.rollout.proxy.responses_api` / :mod:`~relax_agent.rollout.proxy.messages_api`:
  ``/v1/responses`` and ``/v1/messages`` as translations to and from it;
- :mod:`~relax_agent.rollout.proxy.wire`: the protocol each API implements;
- :mod:`~relax_agent.rollout.proxy.session`: one episode's exact token-in/token-out state;
- :mod:`~relax_agent.rollout.proxy.server`: the FastAPI server on 127.0.0.1;
- :mod:`~relax_agent.rollout.proxy.check`: ``relax-agent agent check``, a conformance check of agent programs.
"""
