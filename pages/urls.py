from django.urls import path

from pages import views

app_name = "pages"
urlpatterns = [
    path("", views.overview, name="overview"),
    path("runs/", views.run_list, name="runs"),
    path("runs/<int:run_id>/", views.run_detail, name="run-detail"),
    path("runs/<int:run_id>/row/", views.run_row, name="run-row"),
    path("runs/<int:run_id>/cancel", views.cancel, name="run-cancel"),
    path("runs/<int:run_id>/retry", views.retry, name="run-retry"),
    path("runs/<int:run_id>/log", views.step_log, name="step-log"),
    path("hosts/", views.hosts, name="hosts"),
]
