"""The target model as extraction meets it: its construction from config objects, which layers feed the drafter, and what each rank of a torchrun world holds."""
