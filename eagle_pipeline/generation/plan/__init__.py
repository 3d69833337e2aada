"""What a run requests: the prompts not yet answered (`pending`) and the turns of each conversation (`turns`)."""
