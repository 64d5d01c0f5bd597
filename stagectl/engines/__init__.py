"""Inference engines (core): the `Engine` protocol and its plain data (`interface`), the engines behind it
(`hf` with `hf_adapter` and `sampling`, `vllm`, `fake`), and what they share (`batching`: the batching
worker; `text`: chat messages and stop strings). The rollout server (`stagectl.server`) serves them;
weight sync writes into them through its own small `weightsync.gate.WeightTarget` protocol."""
