def TokensPrompt(prompt_token_ids):  # vLLM's is a TypedDict: a dict with this one key
    return {"prompt_token_ids": prompt_token_ids}
