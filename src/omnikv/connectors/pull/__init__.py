"""What the pull-model connectors (Mooncake Transfer Engine, NIXL) share: the control plane
(messages, server, client), host detection and the connector glue above their two sides."""
