"""The firewall domain: policy rules as an nftables table of plexd's own (`ruleset`, `plan`, `nft`)."""
