"""The engines a workload runs on: minisgl and Hugging Face transformers in this process
(`PhaseRunner` subclasses), vLLM's CPU backend in its own venv (`run_vllm_peer`)."""
