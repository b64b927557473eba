"""The Tinker API (``/api/v1``) on the OpenTinker server: what the official ``tinker`` SDK calls in a LoRA training
and sampling loop, served from one base model in memory with an adapter and optimiser per client, by an engine that
runs as a Ray actor outside the API process (``actor``; the API's side is ``remote``).

``wire`` (the SDK's protobuf and JSON types, both ways), ``service`` (what each call does), ``sessions`` (sessions,
models, samplers, sequence order), ``futures`` (long-polled results), ``engine`` (the worker thread), ``sampling``
(sampler adapters), ``store`` (``tinker://`` checkpoints with TTLs), ``tracking`` (an MLflow run per client). The
routes are ``opentinker.server.routers.tinker``; the model maths is ``opentinker.agents`` (``multi_lora``,
``adapter_trainer``, ``token_losses``, ``lm_sampler``).
"""
