"""Where answers are kept: the rows of the responses and errors tables (`rows`), the answer log (`answer_log`), the
sink that commits them (`sink`) into shards (`shards`), what served a row (`identity`), which rows answer the current
prompts (`coverage`) and the retirement of rows (`retire`)."""
