"""RL algorithms: advantage estimators and policy losses."""
