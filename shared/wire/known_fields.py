"""Request fields that are known without being modelled: OpenAI's documented arguments
our engine does not act on, and stock engines' own extensions, each listed once with
its source.

The rule (shared/wire/protocol.py): a top-level field of a chat or completions request
that is neither a field of our models nor in these lists is refused with 400, naming it,
as OpenAI's API answers an unrecognized argument (`max_token` for `max_tokens` was
silently ignored before, issue 31). A field listed here passes the router unchanged to
the worker, which may ignore it (a vLLM or SGLang behind `radix-worker attach` acts on
it). Nested objects (messages, stream_options) stay lenient.

Sources (read for this list; update it when an engine adds a documented field):
- OpenAI: https://platform.openai.com/docs/api-reference/chat/create and
  .../completions/create (`service_tier` and `prompt_cache_key` included).
- vLLM: vllm/entrypoints/openai/protocol.py, `ChatCompletionRequest` and
  `CompletionRequest` ("chat-completion-sampling-params", "chat-completion-extra-params",
  "completion-sampling-params", "completion-extra-params"), vllm-project/vllm at
  0052bed36509c7a5a2d8e48265334e40cf2f5a0e.
- SGLang: python/sglang/srt/entrypoints/openai/protocol.py, `ChatCompletionRequest` and
  `CompletionRequest` ("Extra parameters for SRT backend only"), sgl-project/sglang at
  004c82e07d876f6e4a0ad6e15325706b0f478f1a.
"""

from __future__ import annotations

OPENAI_CHAT = frozenset({
    "audio", "function_call", "functions", "metadata", "modalities", "parallel_tool_calls",
    "prediction", "prompt_cache_key", "reasoning_effort", "response_format",
    "safety_identifier", "service_tier", "store", "tool_choice", "tools", "verbosity",
    "web_search_options",
})  # fmt: skip
OPENAI_COMPLETIONS = frozenset({"best_of", "suffix", "prompt_cache_key", "service_tier"})

_VLLM_SAMPLING = frozenset({
    "best_of", "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty",
    "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "prompt_logprobs", "allowed_token_ids", "bad_words",
})  # fmt: skip
_VLLM_EXTRA = frozenset({
    "add_special_tokens", "response_format", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "structural_tag", "guided_decoding_backend", "guided_whitespace_pattern",
    "priority", "request_id", "logits_processors", "return_tokens_as_token_ids",
    "cache_salt", "kv_transfer_params", "vllm_xargs", "mm_processor_kwargs",
})  # fmt: skip
VLLM_CHAT = _VLLM_SAMPLING | _VLLM_EXTRA | frozenset({
    "echo", "add_generation_prompt", "continue_final_message", "documents", "chat_template",
    "chat_template_kwargs", "include_reasoning",
})  # fmt: skip
VLLM_COMPLETIONS = _VLLM_SAMPLING | _VLLM_EXTRA | frozenset({"prompt_embeds"})

_SGLANG_COMMON = frozenset({
    "return_hidden_states", "return_routed_experts", "routed_experts_start_len",
    "return_cached_tokens_details", "return_token_ids", "top_k", "min_p", "min_tokens",
    "regex", "ebnf", "repetition_penalty", "stop_token_ids", "stop_regex", "no_stop_trim",
    "ignore_eos", "skip_special_tokens", "lora_path", "session_id", "session_params",
    "response_format", "custom_params", "custom_logit_processor", "images_config",
    "bootstrap_host", "bootstrap_port", "bootstrap_room", "routed_dp_rank",
    "disagg_prefill_dp_rank", "data_parallel_rank", "rid", "extra_key", "cache_salt",
    "ngram_corpus_id", "priority",
})  # fmt: skip
SGLANG_CHAT = _SGLANG_COMMON | frozenset({
    "return_prompt_token_ids", "return_meta_info", "task", "continue_final_message",
    "separate_reasoning", "stream_reasoning", "chat_template_kwargs", "max_dynamic_patch",
    "min_dynamic_patch", "use_audio_in_video", "input_ids", "reasoning",
})  # fmt: skip
SGLANG_COMPLETIONS = _SGLANG_COMMON | frozenset({"json_schema", "custom_labels"})

# Endpoint (as `routing_text` names it) -> the fields known beyond our models.
KNOWN_EXTRA: dict[str, frozenset[str]] = {
    "chat": OPENAI_CHAT | VLLM_CHAT | SGLANG_CHAT,
    "completions": OPENAI_COMPLETIONS | VLLM_COMPLETIONS | SGLANG_COMPLETIONS,
}
