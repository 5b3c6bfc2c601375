"""Planning: the hardware, the resolved preset and every choice made from them (device, profile, vec env, precision,
threads), each with its reason; and the SB3 env and model built from a plan. Nothing here trains."""
