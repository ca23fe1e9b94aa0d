"""The thin distributed DPO trainer (dpo-train); imports dpo_data and dpo_state."""
