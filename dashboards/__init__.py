"""Streamlit dashboard of the data lifecycle (reads only the lake)."""
