"""The OpenAI-compatible endpoint of agent-driven rollouts (``rollout.driver: agent``).

- :mod:`~relax_agent.rollout.proxy.openai_api`: the wire format (request validation, bodies);
- :mod:`~relax_agent.rollout.proxy.session`: one episode's exact token-in/token-out state;
- :mod:`~relax_agent.rollout.proxy.server`: the FastAPI server on 127.0.0.1;
- :mod:`~relax_agent.rollout.proxy.check`: ``relax-agent agent check``, a conformance check of agent programs.
"""
