"""The thin distributed DPO trainer; imports dpo_data and dpo_state (lands with issue 4)."""
