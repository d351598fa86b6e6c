"""Shipped recipes (YAML files beside this module); `litft ls` lists them."""
