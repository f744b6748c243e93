from django.urls import path

from runs.api import views

urlpatterns = [
    path("runs", views.RunListCreateView.as_view(), name="run-list"),
    path("runs/<int:run_id>", views.RunDetailView.as_view(), name="run-detail"),
    path("runs/<int:run_id>/cancel", views.RunCancelView.as_view(), name="run-cancel"),
    path("runs/<int:run_id>/retry", views.RunRetryView.as_view(), name="run-retry"),
    path("runs/<int:run_id>/steps/<str:step_id>/logs/<str:stream>", views.StepLogView.as_view(), name="step-log"),
    path("runs/<int:run_id>/events", views.RunEventsView.as_view(), name="run-events"),
    path("policy/evaluate", views.PolicyEvaluateView.as_view(), name="policy-evaluate"),
    path("policy/replay", views.PolicyReplayView.as_view(), name="policy-replay"),
    path("memories", views.MemoryListView.as_view(), name="memory-list"),
    path("jobs/<int:job_id>", views.JobDetailView.as_view(), name="job-detail"),
]
