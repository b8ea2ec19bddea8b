"""The Claw lakehouse dashboard: the data lifecycle, read from the lake only, for the caller
who signed in (their tenant's data; an admin's or local mode: every tenant's)."""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from dashboards import login
from dashboards.data import where

PAGES = Path(__file__).resolve().parent / "app_pages"

st.set_page_config(page_title="Claw lakehouse", page_icon=":material/database:", layout="wide")
pages = [
    st.Page(PAGES / "overview.py", title="Overview", icon=":material/home:", default=True),
    st.Page(PAGES / "collection.py", title="Collection", icon=":material/input:"),
    st.Page(PAGES / "representation.py", title="Representation", icon=":material/search:"),
    st.Page(PAGES / "curation.py", title="Curation", icon=":material/filter_alt:"),
    st.Page(PAGES / "optimization.py", title="Optimization", icon=":material/account_tree:"),
    st.Page(PAGES / "consumption.py", title="Consumption", icon=":material/model_training:"),
]
caller = login.gate(pages)  # the login page, and a stop, until someone is signed in
login.sidebar(caller)
st.sidebar.caption(f"lake: `{where().lake_uri}`")
st.navigation(pages).run()
