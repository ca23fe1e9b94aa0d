"""The export room: `final/` (the policy, adapter or merged model), its model card, and the push to the Hub."""
