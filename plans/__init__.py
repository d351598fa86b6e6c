"""Shipped sweep plans (YAML files beside this module): `litft sweep --plan NAME`."""
