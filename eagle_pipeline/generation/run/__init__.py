"""One generation run: its options (`options`), the live request loop (`live`) and the runner that sets it up, hands
an import to `importing` and tears it down (`runner`)."""
