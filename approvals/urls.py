from django.urls import path

from approvals import views

app_name = "approvals"
urlpatterns = [
    path("", views.inbox, name="inbox"),
    path("bulk", views.bulk_decide, name="bulk"),
    path("grants/", views.grants, name="grants"),
    path("link/<str:token>/", views.decision_link, name="link"),
    path("settings/", views.notification_settings, name="settings"),
    path("grants/<int:grant_id>/revoke", views.revoke_grant, name="revoke-grant"),
    path("<int:request_id>/", views.detail, name="detail"),
    path("<int:request_id>/approve", views.decide, {"verdict": "approve"}, name="approve"),
    path("<int:request_id>/reject", views.decide, {"verdict": "reject"}, name="reject"),
    path("<int:request_id>/approve-edited", views.decide, {"verdict": "approve-edited"}, name="approve-edited"),
]
