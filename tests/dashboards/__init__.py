"""The Streamlit dashboard, rendered for real."""
